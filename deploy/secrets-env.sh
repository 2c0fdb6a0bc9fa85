#!/bin/sh
# Run a command with every compose secret as an environment variable: /run/secrets/<name> becomes
# <NAME> (upper-cased), e.g. nats_password_admin -> NATS_PASSWORD_ADMIN, which nats.conf's auth.conf
# and render-acl.sh read. Used by docker-compose.yml's nats and redis services.
#   usage: secrets-env.sh COMMAND [ARG...]
set -eu
for f in /run/secrets/*; do
  [ -f "$f" ] || continue
  name=$(basename "$f" | tr 'a-z-' 'A-Z_')
  export "$name=$(cat "$f")"
done
exec "$@"
