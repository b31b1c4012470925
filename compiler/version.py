"""zlc's version, in a module of its own so that any layer can name it (bundles and deployment
plans record it) without importing the package's public face."""

__version__ = "0.1.0"
