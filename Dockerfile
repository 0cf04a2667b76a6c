FROM python:3.11-slim
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md LICENSE ./
COPY core ./core
COPY webhooks ./webhooks
COPY ingest ./ingest
COPY tasks ./tasks
COPY models ./models
RUN pip install --no-cache-dir .
# The docs' markdown, which the console serves at /console/docs/ (core/docs.py).
COPY docs ./docs
ENV WEBHOOKS_CONSOLE_DOCS_DIR=/app/docs
RUN useradd --create-home app
USER app
