#!/bin/sh
# As the redis images' entry point: a first argument that is a flag or a .conf file means redis-server;
# redis-server started as root runs as the `redis` user, owning its working directory (/data).
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
  set -- redis-server "$@"
fi
if [ "$1" = redis-server ] && [ "$(id -u)" = 0 ]; then
  find . \! -user redis -exec chown redis '{}' +
  exec setpriv --reuid=redis --regid=redis --init-groups "$0" "$@"
fi
exec "$@"
