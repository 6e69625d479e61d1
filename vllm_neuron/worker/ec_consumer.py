"""A serving engine's side of encoder-disaggregated serving (--ec-transfer-config). As a consumer (a
prefill+decode instance) it reads the media items its encoder cache lacks from the EC connector before the
vision tower is asked; an item no encoder instance wrote is computed here when this engine has the tower, and
otherwise fails its request with an error that says so (the engine core isolates a failed step to the request
that caused it; the API server refuses such requests before, see multimodal/processor.py). As a producer
(ec_producer / ec_both) it writes what its tower computed for other instances."""
from __future__ import annotations

from vllm_neuron.distributed.ec_transfer.connectors import ECConnector, make_ec_connector
from vllm_neuron.distributed.ec_transfer.record import ECTransferError, model_identity
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)


class RemoteEmbeddings:
    def __init__(self, connector: ECConnector) -> None:
        self.connector = connector
        self.loaded = 0  # items read from the connector
        self.computed_here = 0  # items no encoder instance had, computed by this engine's tower

    def fetch(self, missing: dict, can_encode: bool) -> tuple[dict, dict]:
        """({mm_hash: (embeds, deepstack)} read from the connector, {mm_hash: item} still missing); an engine
        that only produces (ec_producer) reads nothing."""
        if not self.connector.config.is_consumer:
            return {}, missing
        found, left = {}, {}
        for h, item in missing.items():
            try:
                value = self.connector.load(h)
            except ECTransferError as e:
                logger.warning("%s", e)
                value = None
            if value is not None and value[0].shape[0] != item.num_tokens:
                logger.warning("Embeddings of media %s hold %d rows, the prompt has %d placeholders: a miss",
                               h[:16], value[0].shape[0], item.num_tokens)
                value = None
            if value is None:
                left[h] = item
            else:
                found[h] = value
        self.loaded += len(found)
        if left and not can_encode:
            raise ECTransferError(
                f"no encoder instance provided the embeddings of {len(left)} media item(s) of this request "
                f"({', '.join(h[:16] for h in left)}) and this engine has no vision tower "
                "(mm_language_model_only): send multimodal requests through `vllm-neuron epd-proxy`")
        self.computed_here += len(left)
        return found, left

    def computed(self, mm_hash: str, embeds, deepstack) -> None:
        """An item this engine's tower encoded: written for others when it produces (ec_producer / ec_both); a
        failed write is logged, the request it was computed for goes on."""
        if not self.connector.config.is_producer:
            return
        try:
            self.connector.save(mm_hash, embeds, deepstack)
        except ECTransferError as e:
            logger.warning("%s", e)


def remote_embeddings(config, hf_config) -> RemoteEmbeddings | None:
    """The EC connector side of an engine with --ec-transfer-config (None without)."""
    ec = config.ec_transfer_config
    if ec is None:
        return None
    return RemoteEmbeddings(make_ec_connector(ec, model_identity(hf_config.to_dict(), config.model)))
