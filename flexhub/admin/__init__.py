"""Node-side tools a person or the DaemonSet runs: ``install``, ``doctor``, ``daemonset``
(``deploy``), plugin-directory detection, ``validate`` (``manifest``), ``demo``, ``state``,
``new-backend`` (``scaffold``) and the kubelet replayer (``harness``) the demo and the tests use.

kubelet's calls never import this package.
"""
