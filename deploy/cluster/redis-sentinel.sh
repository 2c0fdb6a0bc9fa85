#!/bin/sh
# Start a Redis Sentinel of the CoLLM cluster stack (docker-compose.cluster.yml): writes its configuration
# (Sentinel rewrites the file as it learns the replicas and the other Sentinels, so it must be writable)
# and execs redis-server in Sentinel mode. Runs under secrets-env.sh, which exports
# REDIS_PASSWORD_SENTINEL (the data nodes' collm-sentinel user) and REDIS_SENTINEL_PASSWORD (the
# Sentinels' own password, that clients and the other Sentinels log in with).
#   usage: redis-sentinel.sh ANNOUNCE_HOSTNAME
set -eu
: "${REDIS_PASSWORD_SENTINEL:?}" "${REDIS_SENTINEL_PASSWORD:?}"
conf=/data/sentinel.conf
if [ ! -s "$conf" ]; then
  # The primary by address, not by name: Redis 6.2's Sentinel resolves an instance's host name again
  # whenever it looks it up (another Sentinel asking whether it is down, the replicas kept after a
  # failover), and Docker removes a stopped container's name. Monitored as `redis`, a stopped primary
  # was never agreed down (+sdown, no +odown) and was never failed over (compose check, cluster mode).
  primary=$(getent hosts redis | awk '{ print $1; exit }')
  : "${primary:?cannot resolve redis}"
  umask 077
  cat > "$conf" <<CONF
port 26379
dir /data
sentinel resolve-hostnames yes
sentinel announce-hostnames no
sentinel announce-ip $1
requirepass $REDIS_SENTINEL_PASSWORD
sentinel sentinel-pass $REDIS_SENTINEL_PASSWORD
sentinel monitor collm $primary 6379 2
sentinel auth-user collm collm-sentinel
sentinel auth-pass collm $REDIS_PASSWORD_SENTINEL
sentinel down-after-milliseconds collm 5000
sentinel failover-timeout collm 60000
sentinel parallel-syncs collm 1
CONF
  chown redis:redis "$conf" 2>/dev/null || true
fi
exec docker-entrypoint.sh redis-server "$conf" --sentinel
