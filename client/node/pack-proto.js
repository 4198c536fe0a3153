'use strict';
// The package's relay.proto: `npm pack` copies the repository's
// proto/kvrelay/v1/relay.proto into proto/kvrelay/v1/ (prepack) and removes
// the copy after (postpack), so the contract has one source in the
// repository and the tarball carries it byte for byte.
//
//   node pack-proto.js copy|remove

const fs = require('node:fs');
const path = require('node:path');

const SOURCE = path.resolve(__dirname, '../../proto/kvrelay/v1/relay.proto');
const COPY_DIR = path.join(__dirname, 'proto');
const COPY = path.join(COPY_DIR, 'kvrelay', 'v1', 'relay.proto');

const mode = process.argv[2];
if (mode === 'copy') {
  if (!fs.existsSync(SOURCE)) {
    console.error(`pack-proto: ${SOURCE}: missing, expected the repository's relay.proto ` +
                  '(pack client/node inside a kvrelay checkout)');
    process.exit(1);
  }
  fs.mkdirSync(path.dirname(COPY), { recursive: true });
  fs.copyFileSync(SOURCE, COPY);
} else if (mode === 'remove') {
  fs.rmSync(COPY_DIR, { recursive: true, force: true });
} else {
  console.error(`pack-proto: mode ${JSON.stringify(mode)}, expected copy or remove`);
  process.exit(2);
}
