"""Signed webhooks (Standard Webhooks) from the transactional outbox: endpoints from the
INI, the delivery decisions, the signer, the HTTP sender and the delivering process."""
