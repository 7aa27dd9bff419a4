# Type stubs for fastattn.integrations (a namespace for bindings into other libraries).
