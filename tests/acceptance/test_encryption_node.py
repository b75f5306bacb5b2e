"""A Node.js publisher's encrypted params run: the official MongoDB driver's explicit
encryption (``mongodb-client-encryption``, built against Debian's libmongocrypt) encrypts the
params with the data key mtask made, a real worker holding the master key runs the task, its
handler gets the plain params, and only a reader with the key sees them."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import bson
from harness import node, worker_process
from needs import missing
from pymongo import MongoClient

from mtask import TaskClient
from mtask.security.encryption import KEY_FILE_ENV, Encryption, is_ciphertext, sealed

HERE = Path(__file__).parent / "encryption"
SECRET = "node 4242 4242"


def needs_the_driver() -> None:
    if not (HERE / "node_modules" / "mongodb-client-encryption" / "build").is_dir():
        missing(
            "install the Node publisher: apt-get install libmongocrypt-dev; cd "
            "tests/acceptance/encryption; BUILD_TYPE=dynamic CXXFLAGS=-fpermissive npm ci "
            "--build-from-source"
        )


def test_a_node_publishers_encrypted_params_run(
    mongo_uri: str,
    db_name: str,
    mongo: MongoClient[dict[str, Any]],
    tmp_path: Path,
) -> None:
    binary = node()
    needs_the_driver()
    master = tmp_path / "master.key"
    master.write_bytes(base64.b64encode(os.urandom(96)))
    encryption = Encryption.local(master, mongo_uri, db_name)
    encryption.ensure_key()
    published = subprocess.run(
        [binary, str(HERE / "publish.mjs"), mongo_uri, db_name, str(master), "from-node",
         json.dumps({"card": SECRET})],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert published.returncode == 0, published.stderr
    assert json.loads(published.stdout) == {"published": "from-node", "subtype": 6}
    stored = mongo[db_name].tasks.find_one({"_id": "from-node"})
    assert stored is not None and sealed(stored["params"])
    with (
        TaskClient(mongo_uri, database=db_name, encryption=encryption) as client,
        worker_process(mongo_uri, db_name, env={KEY_FILE_ENV: str(master)}),
    ):
        assert client.wait("from-node", timeout=60).status == "succeeded"
        task = client.get("from-node")
        assert task is not None and task.result["params"] == {"card": SECRET}
    done = mongo[db_name].tasks.find_one({"_id": "from-node"})
    assert done is not None and is_ciphertext(done["result"])
    assert SECRET.encode() not in bson.encode(done)
