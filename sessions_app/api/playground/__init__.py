"""The /try/ page: a browser client of the public AAP API, for trying agents (AAP_TRY_PAGE)."""
