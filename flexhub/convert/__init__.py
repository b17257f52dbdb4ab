"""``flexhub convert``: move a FlexVolume PV of flexhub and its bound claim onto flexhub's CSI
driver (same storage, data untouched), and back with ``--rollback``.

* :mod:`flexhub.convert.plan`: pure functions from the FlexVolume PV and claim to the CSI ones
  (and the saved ones back), and the checks that refuse what cannot be converted.
* :mod:`flexhub.convert.kube`: the API calls (one small class over the official client).
* :mod:`flexhub.convert.steps`: the step machine, safe at every step and idempotent after a
  crash at any step: each step reads the world and does only what is still missing.

Never imported on the kubelet path.
"""

from __future__ import annotations
