"""`python -m collm_gateway`: the gateway process (settings from `COLLM_*`, see settings.py)."""

from collm_common import subjects
from collm_common.service import run_service
from collm_gateway.service import serve
from collm_gateway.settings import GatewaySettings


def main() -> None:
    run_service(subjects.SERVICE_GATEWAY, GatewaySettings, serve, instance_id=lambda s: s.gateway_id)


if __name__ == "__main__":
    main()
