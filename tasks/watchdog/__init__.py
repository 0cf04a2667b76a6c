"""The subscription watchdog (issue 38 item 1): the provider's own view of each source's
endpoint, read with the source's API credential (:mod:`.endpoints`), judged by
:mod:`core.watchdog`, recorded as findings (:mod:`models.findings`) by :mod:`.run`, on beat's
schedule (:mod:`.schedule`) and by ``webhooks sources check``."""
