"""Encoder-disaggregated serving (EPD): the encoder instance's server and the epd-proxy."""
