"""The HTTP server, the CLI, real clients, the docs examples and the serving benchmark."""
