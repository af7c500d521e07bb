"""Orchard's head node, as rooms: `cli`, `checks`, `lm` (the lm-eval models `mlx`, `mlx-ray`), `steering`, `sweep`.

`import driver` registers the models with lm-eval. lm-eval's own backends are registered lazily when
`lm_eval.models` is first imported; importing it first keeps them visible next to ours.
"""

import lm_eval.models  # noqa: F401  (must precede our registrations)

from driver.lm import mlx, mlx_ray  # noqa: F401,E402  register "mlx" and "mlx-ray"
