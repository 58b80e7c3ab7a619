# Production image for every Backlot process (web, a worker per queue, beat, relay, flower);
# the command picks the role (see docker-compose.yml / Procfile).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BACKLOT_DATA_DIR=/data

# Shared libraries WeasyPrint (PDF reports) needs at run time, and a font.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        libpango-1.0-0 libpangoft2-1.0-0 libharfbuzz-subset0 fonts-dejavu-core \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 app \
    && mkdir -p /data/media \
    && chown -R app:app /data

WORKDIR /app
COPY . .
# The platform (the backlot wheel: jobs/) and the reference project's dependencies; the
# project's own packages (config/, emails/, ...) run from /app, the working directory.
RUN pip install '.[project]' \
    && python manage.py collectstatic --noinput

USER app
EXPOSE 8000 5555
CMD ["gunicorn", "config.wsgi:application", "--bind", "0.0.0.0:8000", "--workers", "2", "--timeout", "30"]
