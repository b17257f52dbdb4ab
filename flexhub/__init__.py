"""flexhub: one FlexVolume driver for many kinds of storage."""

import logging

__version__ = "0.1.0"
DRIVER_NAME = "k8s/flexhub"
ENTRY_POINT_GROUP = "flexhub.backends"

logging.getLogger(__name__).addHandler(logging.NullHandler())
