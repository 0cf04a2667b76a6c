FROM python:3.11-slim
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY webhooks ./webhooks
COPY ingest ./ingest
COPY tasks ./tasks
COPY models ./models
RUN pip install --no-cache-dir .
RUN useradd --create-home app
USER app
