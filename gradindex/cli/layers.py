"""``gradindex layers MODEL_DIR``: list hookable layers and the default selection (a folder or a .gguf file)."""

from __future__ import annotations

import click

from gradindex.cli import main
from gradindex.cli.common import user_errors


@main.command()
@click.argument("model_dir", type=click.Path())
@click.option("--layers", multiple=True, help="Glob patterns to test.")
@user_errors
def layers(model_dir, layers):
    """List the model's hookable linear layers; '*' marks the ones selected."""
    from gradindex.capture import layer_info, select_layers, unhooked_weights
    from gradindex.capture.hooks import attributed_share, hookable_layers
    from gradindex.model import load_causal_lm

    model, _ = load_causal_lm(model_dir, device="cpu")
    chosen = select_layers(model, layers or None)
    for name, mod in hookable_layers(model).items():
        i = layer_info(mod)
        mark = "*" if name in chosen else " "
        click.echo(f"{mark} {name}  {i.kind} {i.n_in}->{i.n_out}{' +bias' if i.bias else ''}")
    if not layers:
        for glob in unhooked_weights(model, chosen):
            click.echo(f"! {glob}  not hookable (no capture rule): not attributed")
    click.echo(f"{len(chosen)} layers selected: {100 * attributed_share(model, chosen):.1f}% of the non-embedding "
               "parameters")
