"""The device side: cache layouts, gather and scatter into host staging, pieces, fingerprints.

See README.md here."""
