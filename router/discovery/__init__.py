"""Kubernetes service discovery for the router: `--service-discovery` with SGLang's flag names.

kube_types (the API's fields), kube_client (credentials, LIST, WATCH over httpx), pod_match
(selectors, pod -> worker), service_discovery (the LIST/WATCH/resync loop).
"""

from router.discovery.service_discovery import ServiceDiscovery

__all__ = ["ServiceDiscovery"]
