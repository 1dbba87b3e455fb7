#!/bin/sh
# Installs a requirements file into an image, with the Postgres driver built
# from source against Debian's libpq (`psycopg2`), as its authors advise for
# production, instead of the `psycopg2-binary` wheel that development installs
# use: that wheel bundles its own libpq and OpenSSL, which the image's security
# updates never reach.
#
#   docker/install-requirements.sh requirements-api.txt               # the API image
#   KEEP_COMPILER=1 docker/install-requirements.sh requirements.txt   # workers
#
# Run from the folder that holds the requirements files (it rewrites the
# psycopg2-binary line of requirements-api.txt there). The build-only packages
# are removed again; the compiler stays where KEEP_COMPILER=1 (a worker builds
# its CPU kernels, models/native/qgemm.c, when it starts).
set -eu
requirements=${1:?usage: install-requirements.sh REQUIREMENTS_FILE}
apt-get update
apt-get install -y --no-install-recommends libpq5 libpq-dev gcc libc6-dev
sed -i 's/^psycopg2-binary\([<>=!~ ]\|$\)/psycopg2\1/' requirements-api.txt
grep -q '^psycopg2-binary' requirements-api.txt && { echo "psycopg2-binary still listed" >&2; exit 1; }
pip install --no-binary psycopg2 -r "$requirements"
# The driver is the source build, linked to the system's libpq.
python -c 'import importlib.metadata as m, psycopg2; print("psycopg2", m.version("psycopg2"), "libpq", psycopg2.__libpq_version__)'
if pip show psycopg2-binary >/dev/null 2>&1; then
    echo "psycopg2-binary is installed" >&2
    exit 1
fi
if [ "${KEEP_COMPILER:-0}" = 1 ]; then
    apt-get purge -y libpq-dev
else
    apt-get purge -y libpq-dev gcc libc6-dev
fi
apt-get autoremove -y
rm -rf /var/lib/apt/lists/*
python -c 'import psycopg2'  # libpq5 stayed
