"""The ``specgate`` command: every part's commands mounted on one Typer app.

This is the composition root's command line; each group is defined by the
part it belongs to (``controlplane.cli``: serve, db, keys, telemetry;
``specgate.commands``: the REST commands; ``sidecar.cli``; ``dashboard.cli``;
``testbed.cli``) and only mounted here.

Exit codes: 0 done, 1 the control plane refused (4xx/5xx, message printed),
2 bad usage or input file, 3 the control plane could not be reached.
"""

from __future__ import annotations

import sys

import typer

from controlplane.cli import db_app, generation_app, keys_app, serve, signing_key_app, telemetry_app
from dashboard.cli import dashboard
from sidecar.cli import sidecar
from sidecar.loadgen_cli import loadgen
from specgate.commands.analysis import analysis_app, recommend_app
from specgate.commands.autopilot import autopilot_app
from specgate.commands.fleet import killswitch_app, workers
from specgate.commands.pairs import check_pair
from specgate.commands.policies import apply, rollback
from specgate.commands.rollouts import rollout_app
from specgate.reccheck import recommend_check_cmd
from specgate.up import up
from testbed.cli import testbed_app

app = typer.Typer(help="specgate: per-request speculative decoding control plane.", no_args_is_help=True,
                  add_completion=False)

# server side: the database directly
app.command()(serve)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(signing_key_app, name="signing-key")
app.add_typer(generation_app, name="generation")
app.add_typer(telemetry_app, name="telemetry")
# client side: the REST API
app.command()(apply)
app.add_typer(rollout_app, name="rollout")
app.command()(rollback)
app.add_typer(killswitch_app, name="killswitch")
app.command()(workers)
app.add_typer(analysis_app, name="analysis")
app.add_typer(recommend_app, name="recommend")
app.add_typer(autopilot_app, name="autopilot")
# the other deployables and the local product
testbed_app.command("recommend-check")(recommend_check_cmd)
app.add_typer(testbed_app, name="testbed")
app.command(help="Bring the product up locally (what `make run` runs).")(up)
app.command(name="check-pair")(check_pair)
app.command(name="sidecar")(sidecar)
app.command(name="loadgen")(loadgen)
app.command(name="dashboard")(dashboard)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
