"""The operator console: server-rendered pages on the admin plane at ``/console/``.

See :mod:`ingest.console.routes`; templates and static files ship inside this package.
"""

from ingest.console.routes import create_console

__all__ = ["create_console"]
