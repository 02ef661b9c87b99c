#!/usr/bin/env python3
"""Generate SuperNode authentication key pairs (EC P-384, what ``flwr supernode register`` accepts).

    python deploy/gen_node_keys.py --out deploy/keys --count 3

Writes ``supernode-<i>`` (private key, OpenSSH PEM, stays on that SuperNode's machine; passed with
``--auth-supernode-private-key``) and ``supernode-<i>.pub`` (OpenSSH public key, registered on the
SuperLink with ``flwr supernode register deploy/keys/supernode-<i>.pub <connection>``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec


def generate(out: str | Path, count: int, prefix: str = "supernode") -> list[tuple[Path, Path]]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for i in range(count):
        key = ec.generate_private_key(ec.SECP384R1())
        priv, pub = out / f"{prefix}-{i}", out / f"{prefix}-{i}.pub"
        priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
        os.chmod(priv, 0o600)
        pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                      serialization.PublicFormat.OpenSSH) + b"\n")
        pairs.append((priv, pub))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "keys"))
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--prefix", default="supernode")
    a = ap.parse_args()
    for priv, pub in generate(a.out, a.count, a.prefix):
        print(f"{priv}  {pub}")


if __name__ == "__main__":
    main()
