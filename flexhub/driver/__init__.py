"""The kubelet path: what one FlexVolume call runs, and nothing else.

``kubelet`` parses the call and answers it; ``call`` holds the per-call record and the reply;
``loader`` finds backends (stevedore), ``validation`` checks options (jsonschema), ``memo`` keeps
both answers between calls; ``deadline`` bounds a call; ``logs`` and ``logsetup`` write the
node's log. Nothing here imports the admin tools (:mod:`flexhub.admin`), the CLI, the
conformance kit or the provisioner; ``tests/core/test_layering.py`` keeps it so.
"""
