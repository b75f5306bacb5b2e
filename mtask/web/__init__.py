"""``mtask serve``: the REST API, the dashboard and the metrics, in one small process."""

from mtask.web.app import create_app

__all__ = ["create_app"]
