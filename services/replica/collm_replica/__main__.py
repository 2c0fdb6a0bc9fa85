"""`python -m collm_replica`: start one replica with settings from COLLM_* environment variables."""

from collm_common import subjects
from collm_common.service import run_service
from collm_replica.settings import ReplicaSettings
from collm_replica.worker import serve


def main() -> None:
    run_service(subjects.SERVICE_REPLICA, ReplicaSettings, serve, instance_id=lambda s: s.replica_id)


if __name__ == "__main__":
    main()
