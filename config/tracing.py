"""OpenTelemetry for the reference project (pip install 'backlot[otel]'): traces of requests
(Django's instrumentation) and of jobs (jobs.core.tracing), configured from the standard OTEL_*
variables and sent over OTLP/HTTP. Nothing happens unless they ask for an exporter.

- OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): where spans go;
  OTEL_TRACES_EXPORTER=otlp|console|none picks the exporter (none turns tracing off).
- OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_* and
  OTEL_EXPORTER_OTLP_HEADERS are read by the SDK itself.
  https://opentelemetry.io/docs/languages/sdk-configuration/general/

The span processor exports from a thread, which does not survive a fork: a prefork worker
configures each pool process in worker_process_init, after the fork, and flushes it in
worker_process_shutdown; gunicorn configures each web process as it loads config.wsgi.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

EXPORTERS = ("otlp", "console")


def tracing_wanted(environ: Any = os.environ) -> bool:
    """Whether the environment asks for traces (the SDK's own OTEL_SDK_DISABLED included)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter in EXPORTERS
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def configure_tracing(*, web: bool) -> Any:
    """Install the SDK's TracerProvider (once per process) when the environment asks for it,
    and instrument Django's requests when `web`; returns the provider, or None."""
    if not tracing_wanted():
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        logger.warning("OTEL_* asks for traces but OpenTelemetry is not installed: backlot[otel]")
        return None
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(resource=Resource.create())
        if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
            exporter: Any = ConsoleSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
    if web:
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        instrumentor = DjangoInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=provider)
    return provider


def flush_tracing() -> None:
    """Send the spans still buffered (a pool process is about to exit)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return
    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush is not None:
        flush()


def trace_worker_processes() -> None:
    """Configure tracing in each process that runs jobs: every prefork pool process after the
    fork, or the worker itself with a pool that does not fork (solo, threads)."""
    from celery.signals import worker_init, worker_process_init, worker_process_shutdown

    def pool_process_started(**_: Any) -> None:
        configure_tracing(web=False)

    def worker_started(sender: Any = None, **_: Any) -> None:
        pool = getattr(sender, "pool_cls", "prefork")  # still the name or alias at worker_init
        name = pool if isinstance(pool, str) else f"{pool.__module__}.{pool.__qualname__}"
        if "prefork" not in name and name != "processes":
            configure_tracing(web=False)

    def pool_process_stopping(**_: Any) -> None:
        flush_tracing()

    worker_process_init.connect(pool_process_started, weak=False, dispatch_uid="backlot-otel")
    worker_init.connect(worker_started, weak=False, dispatch_uid="backlot-otel")
    worker_process_shutdown.connect(pool_process_stopping, weak=False, dispatch_uid="backlot-otel")
