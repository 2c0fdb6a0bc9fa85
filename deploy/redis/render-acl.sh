#!/bin/sh
# Render a Redis ACL file template (deploy/redis/users.acl) to stdout: comment and blank lines are
# dropped, and every ${NAME} is replaced by the environment variable NAME. Fails, naming the variable,
# when one is unset or empty or holds whitespace, so a missing password never becomes an empty one.
#   usage: render-acl.sh TEMPLATE > users.acl
set -eu
exec awk '
/^[[:space:]]*(#|$)/ { next }
{
  line = $0
  out = ""
  while (match(line, /\$\{[A-Za-z_][A-Za-z0-9_]*\}/)) {
    name = substr(line, RSTART + 2, RLENGTH - 3)
    value = ENVIRON[name]
    if (value == "") { printf "render-acl: %s is not set\n", name > "/dev/stderr"; exit 1 }
    if (value ~ /[[:space:]]/) { printf "render-acl: %s contains whitespace\n", name > "/dev/stderr"; exit 1 }
    out = out substr(line, 1, RSTART - 1) value
    line = substr(line, RSTART + RLENGTH)
  }
  print out line
}' "$1"
