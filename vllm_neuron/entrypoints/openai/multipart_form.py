"""A multipart/form-data body (the /v1/audio routes' uploads) -> its text fields and files, parsed by the
standard library's MIME parser once the body is read within the size limit (request_body.read_body).
Every malformed body is a 400 naming the problem."""
from __future__ import annotations

from dataclasses import dataclass, field
from email import policy
from email.parser import BytesParser

from vllm_neuron.entrypoints.openai.errors import BadRequestError, UnsupportedMediaTypeError


@dataclass
class FormData:
    fields: dict[str, list[str]] = field(default_factory=dict)  # name -> its values, in order
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # name -> (file name, content)

    def value(self, name: str) -> str | None:
        """The field's last value (a repeated scalar field: the last one wins, as in browsers' forms)."""
        values = self.fields.get(name)
        return values[-1] if values else None


def check_multipart(content_type: str | None) -> None:
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != "multipart/form-data":
        raise UnsupportedMediaTypeError("Unsupported Media Type: this route takes 'multipart/form-data' (an upload "
                                        f"with a `file` field), got {media_type or 'none'}.")


def parse_form(content_type: str, body: bytes) -> FormData:
    check_multipart(content_type)
    if "boundary=" not in content_type:
        raise BadRequestError("the multipart/form-data Content-Type has no boundary.")
    msg = BytesParser(policy=policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1", "replace") + b"\r\nMIME-Version: 1.0\r\n\r\n" + body)
    if not msg.is_multipart() or msg.defects:
        raise BadRequestError("the multipart/form-data body is malformed (missing or mismatched boundaries).")
    form = FormData()
    for part in msg.iter_parts():
        if part.get_content_disposition() != "form-data" or not part.get_param("name", header="content-disposition"):
            raise BadRequestError("a multipart part has no 'Content-Disposition: form-data; name=...' header.")
        name = part.get_param("name", header="content-disposition")
        filename = part.get_filename()
        payload = part.get_payload(decode=True) or b""
        if filename is not None:
            if name in form.files:
                raise BadRequestError(f"the form carries more than one file in field {name!r}.", param=name)
            form.files[name] = (filename, payload)
        else:
            try:
                form.fields.setdefault(name, []).append(payload.decode("utf-8"))
            except UnicodeDecodeError:
                raise BadRequestError(f"form field {name!r} is not UTF-8 text.", param=name) from None
    return form
