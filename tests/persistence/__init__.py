"""The registry, its journal, snapshots, restore and the soak test."""
