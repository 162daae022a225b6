"""NATS credentials and TLS reach every connection: real nats-servers that
require a user/password, a token, or mutual TLS."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.auth import NatsAuth
from pipeline.cli import _started, main, parser
from pipeline.connection import connect
from pipeline.nats_server import NatsServer, NatsServerConfig

USER = NatsAuth(user="mm", password="s3cret")
TOKEN = NatsAuth(token="t0ken-abc")


@pytest.fixture
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NatsServer]:
    auth, extra = request.param
    srv = NatsServer(NatsServerConfig(data_dir=tmp_path / "nats", port=0, auth=auth, extra_config=extra))
    srv.start()
    yield srv
    srv.stop()


async def refused(url: str, auth: NatsAuth) -> str:
    # Reconnecting forever is for a server that went away, not for one that
    # says no: the first connect reports the refusal.
    with pytest.raises(Exception) as info:
        nc, _ = await connect(url, "intruder", auth)
        await nc.close()
    return str(info.value).lower()


@pytest.mark.parametrize("server", [(USER, ""), (TOKEN, "")], indirect=True, ids=["user", "token"])
async def test_credentials_are_required_and_passed(server: NatsServer) -> None:
    auth = server.config.auth
    nc, js = await connect(server.url, "member", auth)
    assert (await js.account_info()).streams == 0
    await nc.close()
    assert "authorization" in await refused(server.url, NatsAuth())
    wrong = NatsAuth(user="mm", password="nope") if auth.user else NatsAuth(token="nope")
    assert "authorization" in await refused(server.url, wrong)


def _certs(tmp: Path) -> dict[str, str]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=mmpipe-test-ca")  # fmt: skip
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")  # fmt: skip
        (tmp / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")  # fmt: skip
    return {name: str(tmp / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


async def test_mutual_tls(tmp_path: Path) -> None:
    certs = _certs(tmp_path)
    tls = (
        f'tls {{\n  cert_file: "{certs["server.pem"]}"\n  key_file: "{certs["server.key"]}"\n'
        f'  ca_file: "{certs["ca.pem"]}"\n  verify: true\n}}\n'
    )
    srv = NatsServer(NatsServerConfig(data_dir=tmp_path / "nats", port=0, extra_config=tls))
    srv.start()
    try:
        url = srv.url.replace("nats://", "tls://")
        auth = NatsAuth(tls_ca=certs["ca.pem"], tls_cert=certs["client.pem"], tls_key=certs["client.key"])
        nc, js = await connect(url, "tls-member", auth)
        assert (await js.account_info()).streams == 0
        await nc.close()
        # No client certificate: the server's verify refuses it.
        await refused(url, NatsAuth(tls_ca=certs["ca.pem"]))
    finally:
        srv.stop()


def test_cli_flags_become_the_environment_and_half_a_pair_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in USER.to_env():
        # setenv first, so the test's end restores these variables' absence.
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    _started("worker", parser().parse_args(["worker", "decode", "--nats-user", "mm", "--nats-password", "s3cret"]))
    assert NatsAuth.from_env() == USER
    monkeypatch.delenv("MMPIPE_NATS_PASSWORD")
    with pytest.raises(SystemExit, match="user and password go together"):
        main(["send", "hi"])
