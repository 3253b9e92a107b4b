"""`dflash cluster`: engine replicas on Ray Serve behind the single server's HTTP front (needs the `cluster` extra)."""
