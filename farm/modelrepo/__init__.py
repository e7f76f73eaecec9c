"""Where models come from: ``repository`` finds a model by name in the model folders
(``farm/models/`` holds the bundled ones), ``caffe_proto`` and ``caffe_net`` read Caffe's
files, ``modelstore`` hashes and caches a model's files, ``modeladd`` adds a user's model."""
