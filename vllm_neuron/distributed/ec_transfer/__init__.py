"""Encoder-disaggregated (EPD) embedding transfer: records that prove what they hold, and the EC connectors."""
