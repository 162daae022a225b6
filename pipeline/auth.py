"""Credentials and TLS for NATS, shared by every process of a deployment.

They come from the environment (``MMPIPE_NATS_*``), so secrets stay out of
command lines (``ps`` shows those) and every process ``mmpipe up`` starts
inherits them; the CLI flags only set the same variables.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, fields
from typing import Any

ENV = {
    "user": "MMPIPE_NATS_USER",
    "password": "MMPIPE_NATS_PASSWORD",
    "token": "MMPIPE_NATS_TOKEN",
    "creds_file": "MMPIPE_NATS_CREDS",
    "nkey_seed_file": "MMPIPE_NATS_NKEY",
    "tls_ca": "MMPIPE_NATS_TLS_CA",
    "tls_cert": "MMPIPE_NATS_TLS_CERT",
    "tls_key": "MMPIPE_NATS_TLS_KEY",
    "tls_hostname": "MMPIPE_NATS_TLS_HOSTNAME",
}


@dataclass(frozen=True)
class NatsAuth:
    user: str = ""
    password: str = ""
    token: str = ""
    # A .creds file (JWT + nkey seed), as `nsc` writes it.
    creds_file: str = ""
    # A file holding an nkey seed (SU...).
    nkey_seed_file: str = ""
    # Verify the server with this CA; present a client certificate for mutual TLS.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_hostname: str = ""

    def __post_init__(self) -> None:
        if bool(self.user) != bool(self.password):
            raise ValueError("NATS user and password go together")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("a NATS TLS client certificate needs its key (and the key its certificate)")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> NatsAuth:
        env = os.environ if environ is None else environ
        return cls(**{name: env.get(var, "") for name, var in ENV.items()})

    def to_env(self) -> dict[str, str]:
        return {ENV[f.name]: value for f in fields(self) if (value := getattr(self, f.name))}

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``."""
        options: dict[str, Any] = {}
        if self.user:
            options.update(user=self.user, password=self.password)
        if self.token:
            options["token"] = self.token
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.nkey_seed_file:
            options["nkeys_seed"] = self.nkey_seed_file
        if self.uses_tls:
            context = ssl.create_default_context(cafile=self.tls_ca or None)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            options["tls"] = context
            if self.tls_hostname:
                options["tls_hostname"] = self.tls_hostname
        return options

    def server_block(self) -> str:
        """The embedded nats-server's ``authorization`` block for the same
        user/password or token (creds, nkeys and TLS are for servers you run)."""
        if self.user:
            return f'authorization {{\n  user: "{_quoted(self.user)}"\n  password: "{_quoted(self.password)}"\n}}\n'
        if self.token:
            return f'authorization {{\n  token: "{_quoted(self.token)}"\n}}\n'
        return ""


def _quoted(value: str) -> str:
    if any(c in value for c in '"\\\n'):
        raise ValueError("NATS credentials for the embedded server may not hold quotes, backslashes or newlines")
    return value
