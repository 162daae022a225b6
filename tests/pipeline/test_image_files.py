"""Images answered by URL, in a real nats-server's object store: what one
bridge keeps another serves (each its own connection), a name never given
is not found, and the bucket's TTL ends an image."""

from __future__ import annotations

from pipeline.bridge.image_files import ImageFiles
from pipeline.config import PipelineConfig
from pipeline.connection import connect
from tests.polling import eventually_true


async def test_one_bridge_keeps_an_image_another_serves_until_its_time_is_up(pipeline_config: PipelineConfig) -> None:
    bucket = pipeline_config.subjects.images_bucket
    first_nc, first_js = await connect(pipeline_config.nats_url, "bridge-1")
    second_nc, second_js = await connect(pipeline_config.nats_url, "bridge-2")
    try:
        keeps, serves = ImageFiles(first_js, bucket, ttl_s=6.0), ImageFiles(second_js, bucket, ttl_s=6.0)
        png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8
        name = await keeps.put(png, "image/png")
        assert name.endswith(".png") and name != await keeps.put(png, "image/png")  # every image its own name
        assert await serves.get(name) == (png, "image/png")
        assert await serves.get(f"{'0' * 32}.png") is None
        assert await serves.get("../MMPIPE_x_IMAGES") is None  # not a name this module gives

        async def gone() -> bool:
            return await serves.get(name) is None

        await eventually_true(gone, within=30, what="the image expires with the bucket's TTL")
    finally:
        await first_nc.close()
        await second_nc.close()
