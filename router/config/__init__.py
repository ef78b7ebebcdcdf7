"""Settings: one YAML file, overridden by `SPECROUTE_*` environment variables.

Pools and backends are maps keyed by name, so names are unique by construction and an
environment variable can reach any of them, e.g. `SPECROUTE_POOLS__FAST__SPECULATIVE=false`.
Every field carries its description: docs/reference/settings.md is generated from them
(`scripts/docs-reference`).
"""

from router.config.base import JobClass
from router.config.batch import Batch, Responses
from router.config.connections import Health, Limits, Retries, Timeouts, Tls
from router.config.fairness import Fairness, KeyGroup, Quota
from router.config.pools import Backend, Discovery, Pool, nameserver
from router.config.routing import PLACEHOLDER_KEYS, Classify, Conversations, Learn, Match, Routing, Rule, Scrape
from router.config.sections import Auth, Headers, Listen, Log, MetricsConfig, Shutdown, Tracing, Traffic
from router.config.settings import CONFIG_ENV, ConfigError, Settings, describe_errors, load_settings, masked
from router.config.state import State

__all__ = [
    "CONFIG_ENV",
    "PLACEHOLDER_KEYS",
    "Auth",
    "Backend",
    "Batch",
    "Classify",
    "ConfigError",
    "Conversations",
    "Discovery",
    "Fairness",
    "Headers",
    "Health",
    "JobClass",
    "KeyGroup",
    "Learn",
    "Limits",
    "Listen",
    "Log",
    "Match",
    "MetricsConfig",
    "Pool",
    "Quota",
    "Responses",
    "Retries",
    "Routing",
    "Rule",
    "Scrape",
    "Settings",
    "Shutdown",
    "State",
    "Timeouts",
    "Tls",
    "Tracing",
    "Traffic",
    "describe_errors",
    "load_settings",
    "masked",
    "nameserver",
]
