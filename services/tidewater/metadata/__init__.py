"""The metadata service: the cluster view the active controller pushes, served to clients."""
