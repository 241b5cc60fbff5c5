// sharp's side of bench/sharp.py: resize every input to a WxH cover (sharp's default fit),
// JPEG at the given quality (sharp's defaults otherwise: 4:2:0, optimised Huffman tables),
// each output written beside its input's name. The whole process is what is measured
// (node start-up and reading the inputs included), as derivd's `run --burst` is.
//
//   node sharp_task.js MODE CORES WIDTH HEIGHT QUALITY OUTDIR INPUT...
//
// MODE `per-core`: libvips one thread per image, CORES images in flight at once;
// MODE `one-image`: libvips CORES threads, one image at a time.
'use strict';

const fs = require('node:fs');
const path = require('node:path');

const [mode, coresArg, widthArg, heightArg, qualityArg, outdir, ...inputs] =
  process.argv.slice(2);
const cores = Number(coresArg);
if (mode === 'per-core') {
  process.env.UV_THREADPOOL_SIZE = String(Math.max(4, cores));
}
const sharp = require('sharp');

sharp.cache(false); // as test/bench/perf.js: no operation cache between images
sharp.concurrency(mode === 'per-core' ? 1 : cores);
const width = Number(widthArg);
const height = Number(heightArg);
const quality = Number(qualityArg);

async function one(input, index) {
  const data = await fs.promises.readFile(input);
  const out = await sharp(data, { autoOrient: true })
    .resize(width, height)
    .jpeg({ quality })
    .toBuffer();
  const name = `${String(index).padStart(4, '0')}-${path.basename(input, path.extname(input))}.jpg`;
  await fs.promises.writeFile(path.join(outdir, name), out);
}

async function main() {
  let next = 0;
  const lanes = mode === 'per-core' ? cores : 1;
  async function lane() {
    while (next < inputs.length) {
      const index = next++;
      await one(inputs[index], index);
    }
  }
  await Promise.all(Array.from({ length: lanes }, lane));
}

main().catch((error) => {
  console.error(`sharp_task: ${error.message}`);
  process.exit(1);
});
