"""How fast a replay may go, apart from :mod:`models.replays` so that ``webhooks replay``
declares its ``--rate`` option (default and cap in its help) without importing SQLAlchemy."""

DEFAULT_RATE = 10.0  # replays per second unless the operator asks otherwise
MAX_RATE = 5000.0  # the cap neither the CLI nor the API may exceed
