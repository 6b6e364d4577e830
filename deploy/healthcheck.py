"""The container's HEALTHCHECK: exit 0 when the server in this container answers 200 on /health, else 1.

Standard library only, so the image needs no curl. The port is the server's (``REGULARLM_PORT``, default
8000); /health answers 503 while the models load and while the server drains after SIGTERM, so a container
is healthy only while it serves.

    python /app/healthcheck.py            # inside the image (its HEALTHCHECK)
    REGULARLM_PORT=9000 python deploy/healthcheck.py
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 2.0


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('REGULARLM_PORT', '8000')}/health"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as error:  # HTTPError (503) is a URLError
        print(f"{url}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
