"""Storage: SQLAlchemy models, the guarded state transitions, database plumbing, migrations."""
