"""The record batch format: header layout (shared by broker and client), validation, codecs."""
