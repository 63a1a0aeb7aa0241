"""Prints, for each variable named in SECRETS_TO_CHECK, its name and the sha256 of its value
(never the value): proof the secret arrived without printing it. Then sleeps SLEEP seconds."""
import hashlib
import os
import time

for name in os.environ["SECRETS_TO_CHECK"].split(","):
    value = os.environ.get(name)
    digest = hashlib.sha256(value.encode()).hexdigest()[:16] if value is not None else None
    print(f"secret {name} {digest}", flush=True)
time.sleep(float(os.environ.get("SLEEP", "2")))
