"""A client generated from ``mtask serve``'s OpenAPI spec by a real generator
(``openapi-python-client`` from PyPI), making real calls against a running server: the spec is
typed enough for a generator to give tasks, options and runs as classes, not maps."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from needs import missing
from webserver import serving

from mtask import TaskClient

TOKEN = "gen-token"
GENERATOR = Path(sys.executable).parent / "openapi-python-client"


def test_a_generated_client_publishes_and_reads(
    mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    if not GENERATOR.exists() and not shutil.which("openapi-python-client"):
        missing("openapi-python-client is not installed (pip install -e '.[dev]')")
    with serving(mongo_uri, db_name, token=TOKEN) as url:
        import httpx

        spec = tmp_path / "openapi.json"
        spec.write_text(json.dumps(httpx.get(f"{url}/openapi.json").json()))
        subprocess.run(
            [str(GENERATOR), "generate", "--path", str(spec), "--meta", "none"],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            timeout=300,
        )
        package = tmp_path / "mtask_client"
        assert (package / "models" / "task_options.py").exists()
        sys.path.insert(0, str(tmp_path))
        try:
            from mtask_client import AuthenticatedClient  # type: ignore[import-not-found]
            from mtask_client.api.default import (  # type: ignore[import-not-found]
                get_task_tasks_key_get,
                publish_tasks_post,
            )
            from mtask_client.models import (  # type: ignore[import-not-found]
                PublishBody,
                PublishView,
                StoredOptions,
                TaskOptions,
                TaskView,
            )

            with AuthenticatedClient(base_url=url, token=TOKEN) as api:
                body = PublishBody(name="gen", key="gen/1", options=TaskOptions(priority=7))
                published = publish_tasks_post.sync(client=api, body=body)
                assert isinstance(published, PublishView) and published.created
                read = get_task_tasks_key_get.sync("gen/1", client=api)
            assert isinstance(read, TaskView)
            # a read shows the options as stored (typed: a model, not a map)
            assert read.key == "gen/1" and isinstance(read.options, StoredOptions)
            assert read.options.priority == 7
        finally:
            sys.path.remove(str(tmp_path))
            for name in [m for m in sys.modules if m.startswith("mtask_client")]:
                del sys.modules[name]
    task = client.get("gen/1")
    assert task is not None and task.options.priority == 7
