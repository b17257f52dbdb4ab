"""flexhub: one FlexVolume driver for many kinds of storage."""

__version__ = "0.1.0"
DRIVER_NAME = "k8s/flexhub"
ENTRY_POINT_GROUP = "flexhub.backends"
