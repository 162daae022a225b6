"""Credentials and TLS for NATS, shared by every process of a deployment.

They are settings like any other (``--nats-user`` or ``MMPIPE_NATS_USER``, a
config file); the CLI puts what it resolved into its environment, so the
connection reads them there and every process it starts inherits them, and
secrets stay out of command lines (``ps`` shows those).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, fields
from typing import Any

from schemas.settings import SETTING, setting


@dataclass(frozen=True)
class NatsAuth:
    user: str = setting("", flag="nats-user", help="NATS user (with --nats-password)")
    password: str = setting("", flag="nats-password", help="NATS password")
    token: str = setting("", flag="nats-token", help="NATS token")
    creds_file: str = setting("", flag="nats-creds", help="a .creds file (JWT + nkey seed), as `nsc` writes it")
    nkey_seed_file: str = setting("", flag="nats-nkey", help="a file holding an nkey seed (SU...)")
    tls_ca: str = setting("", flag="nats-tls-ca", help="verify the NATS server with this CA")
    tls_cert: str = setting("", flag="nats-tls-cert", help="a client certificate for mutual TLS (with its key)")
    tls_key: str = setting("", flag="nats-tls-key", help="the client certificate's key")
    tls_hostname: str = setting("", flag="nats-tls-hostname", help="the server name TLS verifies")

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


# The variables are the settings' own (MMPIPE_ and the flag), so the
# credentials given as flags, as variables or in a config file are one set.
ENV = {f.name: "MMPIPE_" + f.metadata[SETTING].flag.upper().replace("-", "_") for f in fields(NatsAuth)}


def _quoted(value: str) -> str:
    if any(c in value for c in '"\\\n'):
        raise ValueError("NATS credentials for the embedded server may not hold quotes, backslashes or newlines")
    return value
