"""The data plane's stores: KV layout, checksums, host memory slots, local disk.

Submodules are imported explicitly (`kvtier.store.disk_store`, ...): only `memory` needs
torch, so tools that recover or inspect a disk directory stay light.
"""
