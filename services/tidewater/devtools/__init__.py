"""Tools for developing Tidewater itself (code generation); not used at run time."""
