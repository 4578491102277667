"""Prometheus metrics; the only package that imports prometheus_client."""

from flexserve.metrics.prometheus import PrometheusStatLogger

__all__ = ["PrometheusStatLogger"]
