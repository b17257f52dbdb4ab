"""``flexhub provisioner``: PersistentVolumes made for claims of flexhub StorageClasses."""
