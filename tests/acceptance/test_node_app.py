"""A real client no one here wrote against derivd's Python: a Node upload service
(tests/node/upload.mjs, with `pg`, `@aws-sdk/client-s3` and `standardwebhooks` from npm)
PUTs an original to moto's S3 under a prefix, INSERTs its row with an external id and
metadata, receives `file.ready` on its own HTTP server and verifies it, GETs every variant
by the bucket and key the payload names, and deletes the file through the SQL function.
`derivd run` does the rest, configured with the same bucket and prefix. On the fs store
(the embedded default's) the program writes the original by the store's documented
layout and reads the variants the same way."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from configs import write_ini
from fixtures.cli import derivd_command
from fixtures.s3 import MotoServer, free_port
from helpers import sql, stop_process
from imagegen import jpeg
from psycopg.conninfo import conninfo_to_dict

NODE_APP = Path(__file__).parents[1] / "node"
SECRET = "whsec_" + base64.b64encode(b"node upload service test secret!").decode()
PREFIX = "app/"
NODE_TIMEOUT_S = 120  # a hang fails the test with its output instead of blocking the run


def _node_ready() -> str | None:
    """Why the Node program cannot run here, or None (`make test` installs its modules)."""
    if shutil.which("node") is None:
        return "node is not installed (etc/system-deps.sh installs it)"
    if not (NODE_APP / "node_modules" / "standardwebhooks").is_dir():
        return "tests/node/node_modules is missing: `make install` runs npm ci there"
    return None


def _url(dsn: str) -> str:
    """The test database's DSN as the URL node-postgres takes (TCP, no password)."""
    params = conninfo_to_dict(dsn)
    user, db = quote(str(params["user"])), quote(str(params["dbname"]))
    return f"postgresql://{user}@{params['host']}:{params['port']}/{db}"


@pytest.fixture(params=["s3", "fs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """[storage] of derivd, and the program's environment for the same store."""
    if request.param == "fs":
        root = tmp_path / "objects"
        return {"backend": "fs", "root": root}, {"FS_ROOT": str(root)}
    server: MotoServer = request.getfixturevalue("s3_server")
    bucket: str = request.getfixturevalue("s3_bucket")
    settings = {"backend": "s3", "bucket": bucket, "prefix": PREFIX, "region": "us-east-1",
                "endpoint_url": server.endpoint_url}  # fmt: skip
    return settings, {"S3_ENDPOINT": server.endpoint_url, "BUCKET": bucket}


def test_a_node_upload_service_uses_derivd_through_sql_and_webhooks(
    dsn: str, tmp_path: Path, store: tuple[dict[str, Any], dict[str, str]]
) -> None:
    if reason := _node_ready():
        pytest.skip(reason)
    storage, store_env = store
    port = free_port()
    ini = write_ini(tmp_path / "derivd.ini", {
        "database": {"dsn": dsn},
        "storage": storage,
        "supervisor": {"workers": 1, "state_dir": tmp_path / "state"},
        "derive": {"backend": "pillow", "variants": "preview:64, thumb:32"},
        "webhook:app": {"url": f"http://127.0.0.1:{port}/hooks", "secret": SECRET,
                        "events": "file.ready"},
    })  # fmt: skip
    image = tmp_path / "photo.jpg"
    image.write_bytes(jpeg(96, 72))
    env = dict(os.environ, DATABASE_URL=_url(dsn), PREFIX=PREFIX, WEBHOOK_SECRET=SECRET,
               PORT=str(port), IMAGE=str(image), **store_env)  # fmt: skip
    with (tmp_path / "derivd.log").open("w") as log:
        daemon = subprocess.Popen([*derivd_command(), "-c", str(ini), "run"],
                                  stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT)  # fmt: skip
        try:
            app = subprocess.run(["node", str(NODE_APP / "upload.mjs")], env=env,
                                 capture_output=True, text=True,
                                 timeout=NODE_TIMEOUT_S)  # fmt: skip
        finally:
            stop_process(daemon)
    assert app.returncode == 0, app.stderr + (tmp_path / "derivd.log").read_text()
    out = json.loads(app.stdout)
    assert out["key"].startswith(f"{PREFIX}uploads/") and out["original_key"] == out["key"]
    assert out["external_id"] == "photo-42"
    assert out["metadata"] == {"album": "holidays", "owner": 7}
    variants = sql(dsn, "SELECT key, bytes FROM archive_variants WHERE file_id = %s"
                        " ORDER BY name, format", (out["id"],))  # fmt: skip
    assert out["variants"] == variants and len(variants) == 2
    # Keys as the store names them: derivd writes under [storage] prefix (s3 only).
    written = storage.get("prefix", "")
    assert all(v["key"].startswith(f"{written}derived/{out['id']}/") for v in variants)
    assert out["bucket"] == storage.get("bucket")
    assert out["deleted"] == "deleting"
    [row] = sql(dsn, "SELECT status, original_key FROM archive_files WHERE id = %s", (out["id"],))
    assert row == {"status": "deleting", "original_key": out["key"]}


def test_the_docs_show_the_program_the_suite_runs() -> None:
    """docs/integrating.md's "From any other language" is this program, as it runs here."""
    program = (NODE_APP / "upload.mjs").read_text(encoding="utf-8")
    page = (NODE_APP.parent.parent / "docs" / "integrating.md").read_text(encoding="utf-8")
    first = program.splitlines()[0]
    if f"```js\n{first}\n" not in page:
        pytest.skip("docs/integrating.md does not show the Node upload service yet")
    shown = page.split(f"```js\n{first}\n", 1)[1].split("```", 1)[0]
    assert f"{first}\n{shown}" == program
