"""The ground floor: settings, clock, durations, crypto, TTL arithmetic, logs, metrics,
the provider contracts and the message contract. It imports nothing of the project's
other packages (``models``, ``tasks``, ``ingest``, ``webhooks``)."""
